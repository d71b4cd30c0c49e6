"""What a request may spend and what it is charged: keys and admission, compute units and prices, the usage journal."""
