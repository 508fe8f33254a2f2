from orbit.cli.main import main

main()
