"""The dashboard: static HTML, CSS and JavaScript modules, served by gemq.services.api."""
