"""`python -m train.eval`: EleutherAI's lm-evaluation-harness on a run's checkpoint, sharded on the run's mesh.
The flags (`options`), the run's model restored (`load`), requests padded to a few shapes (`batching`), their
scores and generations on the mesh (`scorer`), the harness's model class (`harness`), the results (`results`)."""
