"""The `gpuforge` commands: each class registers its arguments apart from what it does.

A command's `register_arguments(parser)` declares its options; its `execute(args)` maps the parsed
Namespace to the typed functions of a feature module (gpuforge.ami, gpuforge.pcluster, ...) and prints
what they return. Feature modules never parse arguments; gpuforge.cli builds the parser from the
`COMMANDS` of each module here (docs/architecture.md, "The command layer").
"""
