"""The configuration: how a setting is declared (`settings`), the config's sections (`sections`) and model keys
(`model_settings`), the experiment config validated into a Plan (`experiment`), and docs/configuration.md written
from the declarations (`reference`, `python -m train.config`)."""
