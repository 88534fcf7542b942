import sys

from torchgrain.cli import main

sys.exit(main())
