const os = require("os");
console.log(`hello from node ${process.version} inside the sandbox`);
console.log(`running as uid ${process.getuid()} on host ${os.hostname()}`);
console.log(`6 * 7 = ${6 * 7}`);
