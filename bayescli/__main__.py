from bayescli.cli.app import main

main()
