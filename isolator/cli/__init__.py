"""The admin CLI and its renderers: the only code that prints."""
