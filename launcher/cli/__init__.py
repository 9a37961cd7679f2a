"""launcher.cli: The command lines: `ftrun` (ftrun: torchrun's flags, then the agent), `ftctl`
(ftctl: status, report, store, inject) and the injection command's client side (inject).
"""
