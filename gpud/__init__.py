"""gpud: a node daemon for GPU servers."""
__version__ = "0.1.0"
