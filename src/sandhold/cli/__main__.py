from sandhold.cli.main import main

main()
