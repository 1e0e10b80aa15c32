"""The weight-sync wire: what the trainer and an engine must agree on, and nothing else.

Request bodies (`protocol`), tensor payloads (`codec`), dtype names (`dtypes`), bucket planning
(`plan`) and the weight-update process group (`group`). Both sides import this package; it
imports neither (an import-linter contract), so the reference engine never depends on trainer
code and the trainer never on engine code.
"""
