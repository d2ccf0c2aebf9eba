"""servelens: the command line and the configuration tree that tie the packages together.

The work lives in the library packages (``schemas``, ``privacy``, ``pipelines``, ``replay``,
``dashboard``); ``servelens.cli`` is a thin click layer over them and ``servelens.config`` the one
typed configuration tree.
"""

__version__ = "0.1.0"
