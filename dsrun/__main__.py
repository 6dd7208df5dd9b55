from dsrun.cli.__main__ import console

console()
