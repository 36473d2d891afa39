"use strict";
// Swagger UI from this server's own files (no CDN); "Authorize" takes a sandloop token.
window.ui = SwaggerUIBundle({
  url: "/openapi.json",
  dom_id: "#swagger-ui",
  deepLinking: true,
  persistAuthorization: true,
  presets: [SwaggerUIBundle.presets.apis],
});
