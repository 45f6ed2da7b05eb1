"""Export a trained head in the layout a serving engine loads (the same as the `headway-export` command):

    python scripts/export.py checkpoint=RUN/final output=DIR [format=...] [push=true repo_id=ORG/NAME]

The command itself lives in headway.heads.formats.export_cli.
"""

from headway.heads.formats.export_cli import main

if __name__ == "__main__":
    main()
