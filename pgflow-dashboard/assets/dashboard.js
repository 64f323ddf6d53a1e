// pgflow dashboard: refreshes each page's live part (an element with data-refresh) without a full reload.
(function () {
  "use strict";
  document.querySelectorAll("[data-refresh]").forEach(function (el) {
    var every = parseInt(el.getAttribute("data-every"), 10) || 2000;
    var busy = false;
    setInterval(function () {
      if (busy || document.hidden) return;
      busy = true;
      fetch(el.getAttribute("data-refresh"), { credentials: "same-origin" })
        .then(function (r) { return r.ok ? r.text() : null; })
        .then(function (html) {
          if (html !== null) {
            el.innerHTML = html;
            el.setAttribute("data-refreshed", String(Date.now()));
          }
        })
        .catch(function () {})
        .then(function () { busy = false; });
    }, every);
  });
})();
