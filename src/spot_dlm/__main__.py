import sys

from spot_dlm.cli import main

sys.exit(main())
