"""`python -m train.sample`: text sampled from a run's checkpoint on the serving engine (`command`), with prompts
and samples read and written as text (`prompt`)."""
