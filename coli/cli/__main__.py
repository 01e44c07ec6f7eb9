from coli.cli.main import main

main()
