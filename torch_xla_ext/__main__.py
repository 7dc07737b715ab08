from torch_xla_ext.cli import run

run()
