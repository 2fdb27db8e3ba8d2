"""datagen: a Prefect pipeline that generates training data with SGLang on GPU hosts."""

__version__ = "0.1.0"
