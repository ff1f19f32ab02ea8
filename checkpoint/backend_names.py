"""The checkpoint backends' names (--checkpoint-backend, a manifest's ``backend``), stdlib only: a command line offers
and checks them before torch is imported. backends/__init__.py registers one class per name, in this order."""

BACKEND_NAMES: tuple[str, ...] = ("vanilla", "concurrent", "dcp")
FORMATS: tuple[str, ...] = ("vanilla", "dcp")  # what `python -m checkpoint convert --to` writes (convert.py)
