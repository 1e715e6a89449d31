"""The error every part of the configuration raises, in a module of its own: ``sections`` (the
fields) and ``tenants`` (the ``tenants:`` quotas, a field's type) both raise it, and ``sections``
imports ``tenants``; with the error in either of them the two would import each other."""


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field, its source and the fix."""
