"""Variant families. Each module here registers its variants on import (sandbox.registry walks
this package); nothing else imports them by name."""
