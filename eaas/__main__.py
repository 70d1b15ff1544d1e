from eaas.cli import main

main()
