import sys

from benchmarks.tune import main
from utils.errors import exit_on_input_error

sys.exit(exit_on_input_error(main))
