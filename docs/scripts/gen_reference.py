"""Build-time pages (mkdocs-gen-files): each command's flag reference and the OpenRLHF flag table, made
from the configuration tree itself, so the documentation cannot drift from the code."""

import mkdocs_gen_files
from rlhf_cli.config.reference import COMMAND_CONFIGS, flag_reference, openrlhf_table

for command in COMMAND_CONFIGS:
    with mkdocs_gen_files.open(f"reference/{command}.md", "w") as page:
        page.write(flag_reference(command))

with mkdocs_gen_files.open("reference/openrlhf.md", "w") as page:
    page.write(
        "# OpenRLHF flags and their names here\n\n"
        "Each OpenRLHF flag with a counterpart, and the commands that have it. An OpenRLHF flag given to "
        "`rlhf` is answered with its name here. Generated from `rlhf_cli/config/openrlhf_names.py`; see "
        "[Migrating from OpenRLHF](../migrating-from-openrlhf.md) for what differs.\n\n"
    )
    page.write(openrlhf_table())
