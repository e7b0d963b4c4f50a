import sys

from checkpoints_convert.cli import main

sys.exit(main())
