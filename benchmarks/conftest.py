import os

os.environ.setdefault("VEGAS_DISABLE_PLUGIN_AUTOLOAD", "1")
