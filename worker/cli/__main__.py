import sys

from tokenmill.cli import main

if __name__ == "__main__":  # a process spawned by vLLM (or multiprocessing) imports this module again
    sys.exit(main())
