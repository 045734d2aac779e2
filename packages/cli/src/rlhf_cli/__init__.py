"""rlhf-cli: the ``rlhf`` command and the recipes that wire the libraries together on Ray."""

__version__ = "0.1.0"
