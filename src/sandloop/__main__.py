from sandloop.cli.app import main

main()
