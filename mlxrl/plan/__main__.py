import sys

from .. import runtime

runtime.setup(cli=True)  # this file runs only as `python -m mlxrl.plan`

from ..cli.plan import main  # noqa: E402

sys.exit(main())
