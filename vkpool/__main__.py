from vkpool.cli import program

program()
