"""`python -m train.export_hf`: a run's checkpoint written as a Hugging Face directory (`command`); the format
itself is train/hf/'s."""
