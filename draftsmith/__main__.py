"""`python -m draftsmith` (what `torchrun -m draftsmith` runs)."""

from draftsmith.cli import main

if __name__ == "__main__":
    main()
