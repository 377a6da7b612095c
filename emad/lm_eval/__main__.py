"""``python -m emad.lm_eval``: see :func:`emad.lm_eval.main`."""

import sys

from emad.lm_eval import main

sys.exit(main())
