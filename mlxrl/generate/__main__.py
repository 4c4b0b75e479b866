import sys

from .. import runtime

runtime.setup(cli=True)  # this file runs only as `python -m mlxrl.generate`: first, before the rest loads

from .cli import main  # noqa: E402

sys.exit(main())
