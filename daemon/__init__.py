"""moed: a local daemon that runs Mixture-of-Experts models bigger than GPU memory."""

__version__ = "0.1.0"
