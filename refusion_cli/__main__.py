from refusion_cli.cli.app import main

main()
