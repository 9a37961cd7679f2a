"""`python -m launcher` is `ftrun`."""

from launcher.cli.ftrun import main

if __name__ == "__main__":
    main()
