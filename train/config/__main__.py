"""`python -m train.config`: write docs/configuration.md from the settings' declarations (train/config/reference.py)."""
from train.config import reference

if __name__ == "__main__":
    reference.main()
