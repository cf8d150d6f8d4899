"""wamrl: RL fine-tuning of World Action Models (Fast-WAM) on LIBERO."""

__version__ = "0.1.0"
