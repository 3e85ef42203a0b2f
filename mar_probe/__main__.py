"""``python -m mar_probe`` runs the command line, so that ``torchrun -m mar_probe record ...`` starts it."""
import sys

from .cli import main

sys.exit(main())
