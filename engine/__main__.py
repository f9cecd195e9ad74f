import sys

from engine.cli import main
from engine.memory import return_freed_memory

return_freed_memory()
sys.exit(main())
