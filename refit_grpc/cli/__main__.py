"""`python -m refit_grpc.cli`: the same commands as the `refit-grpc` script."""

import sys

from refit_grpc.cli import main

sys.exit(main())
