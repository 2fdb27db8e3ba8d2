import sys

from datagen.cli import main

sys.exit(main())
