"""`python -m launcher` is `ftrun`."""
from launcher.cli import main

if __name__ == "__main__":
    main()
