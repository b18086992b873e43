from benchmarks.compare import main
from utils.errors import exit_on_input_error
from utils.process_end import end_process

end_process(exit_on_input_error(main))  # the work is written: no interpreter teardown (utils/process_end.py)
