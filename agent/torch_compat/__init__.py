"""Adapters over torch's private APIs: one module per torch surface, so a torch release that moves a
private name touches exactly one file. No other module of the package reaches a private torch name
(``tests/project/test_private_names.py`` holds them to it).

Each adapter says the torch versions its names were checked on and what it does where one is missing:
a reader returns a neutral value (None, {}, [], False) and the agent reports less; what a component
cannot work without raises at install, where the agent marks that component down (``up=0``) and counts
the error. Nothing here raises on the training thread."""
