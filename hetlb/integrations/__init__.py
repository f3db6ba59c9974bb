"""hetlb inside the trainers people use: :mod:`hetlb.integrations.lightning` (PyTorch
Lightning's Trainer under DDP). Each module imports its framework when it is imported; without
it, an ImportError names the extra to install (``pip install hetlb[lightning]``)."""
