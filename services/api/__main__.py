from services.api.app import main

main()
