"""hetlb inside the trainers people use, under DDP: :mod:`hetlb.integrations.lightning` (PyTorch
Lightning's Trainer), :mod:`hetlb.integrations.transformers` (Hugging Face's Trainer) and
:mod:`hetlb.integrations.accelerate` (an Accelerate loop), with :mod:`hetlb.integrations.epoch`,
the loader's length as they read it. Each framework module imports its framework when it is
imported; without it, an ImportError names the extra to install (``pip install
hetlb[lightning]``, ``pip install hetlb[hf]``)."""
