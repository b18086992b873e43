import sys

from benchmarks.tune import main

sys.exit(main())
