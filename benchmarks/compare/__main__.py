import sys

from benchmarks.compare import main

sys.exit(main())
